import fsspec
import pytest


@pytest.fixture(scope="session")
def s3_bucket():
    """A bucket on moto's S3 server, reached through s3fs (skipped without either)."""
    pytest.importorskip("s3fs")
    server_mod = pytest.importorskip("moto.server")
    pytest.importorskip("flask")  # (moto's server needs it: the moto[server] extra)
    import s3fs

    server = server_mod.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    old = fsspec.config.conf.get("s3")
    try:
        host, port = server.get_host_and_port()
        endpoint = {"endpoint_url": f"http://{host}:{port}"}
        opts = {"key": "testing", "secret": "testing", "client_kwargs": endpoint}
        fsspec.config.conf["s3"] = opts
        s3fs.S3FileSystem.clear_instance_cache()
        s3fs.S3FileSystem(**opts).mkdir("coatstate-tests")
        yield "s3://coatstate-tests"
    finally:
        if old is None:
            fsspec.config.conf.pop("s3", None)
        else:
            fsspec.config.conf["s3"] = old
        server.stop()
