#!/usr/bin/env bash
# Source this on the GPU machine (no network): installs the carried wheels (.whl/, fetched here by
# ../shared/tools/gpu-wheels) into /tmp/site and the project itself, editable, without deps.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | grep -v WARNING | tail -2
export PYTHONUNBUFFERED=1
