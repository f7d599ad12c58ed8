"""The variants benchmarks/parity_gpu.py trains: per name the optimizer kind, whether
CompiledActivations and FP8Linear are on, and each optimizer kind's CompressedAdamW options (one
deviation from the library's defaults per diagnostic)."""

VARIANTS = {  # name: (optimizer, CompiledActivations (True, or its policy overrides), FP8Linear)
    "adamw": ("adamw", False, False),
    # the recipes, each with the library's defaults (whatever those are when it runs)
    "compressed": ("compressed", False, False),
    "compressed_ca": ("compressed", True, False),
    "full": ("compressed", True, True),
    "master24": ("master", False, False),  # a bfloat16 model: master_bits="auto" gives 24
    # diagnostics, each named by its one deviation from the defaults
    "compressed_plain": ("compressed_plain", False, False),  # FP8 moments without range expansion
    "compressed_expand": ("compressed_expand", False, False),  # COAT's expansion on both moments
    "compressed_m_expand": ("compressed_m_expand", False, False),  # expansion on the first moment only
    "compressed_v_expand": ("compressed_v_expand", False, False),  # expansion on the second moment only
    "master16": ("master16", False, False),  # bfloat16 model, stochastic rounding, no correction
    # q and k in FP8 (ActivationPolicy.attention's default until 2026-12-02, COAT's choice)
    "compressed_ca_attn_group": ("compressed", {"attention": "group"}, False),
    "full_attn_group": ("compressed", {"attention": "group"}, True),
    # the smaller activation policies (options, issue #34): attention's v and output, or the norms'
    # inputs, in FP8 groups instead of kept / bfloat16
    "compressed_ca_v_out_group": ("compressed", {"attention_v_out": "group"}, False),
    "compressed_ca_norm_group": ("compressed", {"norm": "group"}, False),
    # 4-bit moments (issue #33; options, not defaults): 4-bit both, and FP8 m with 4-bit v
    "fp4": ("fp4", False, False),
    "fp4_v": ("fp4_v", False, False),
    "compressed_off": ("compressed_off", False, False),  # compress=False: torch AdamW's math, our step
}
OPTIMIZER_OPTIONS = {
    "compressed": {},
    "master": {},
    "compressed_off": {"compress": False},
    "compressed_plain": {"exp_avg_expand": False, "exp_avg_sq_expand": False},
    "compressed_expand": {"exp_avg_expand": True, "exp_avg_sq_expand": True},
    "compressed_m_expand": {"exp_avg_expand": True, "exp_avg_sq_expand": False},
    "compressed_v_expand": {"exp_avg_expand": False, "exp_avg_sq_expand": True},
    "master16": {"master_bits": 16},
    "fp4": {"exp_avg_format": "e2m1", "exp_avg_sq_format": "ue3m1_sqrt"},
    "fp4_v": {"exp_avg_sq_format": "ue3m1_sqrt"},
}
RECIPES = ("adamw", "compressed", "master24", "compressed_ca", "full")
OPTION_KEYS = {
    "compress",
    "exp_avg_format",
    "exp_avg_sq_format",
    "exp_avg_expand",
    "exp_avg_sq_expand",
    "group_size",
    "min_numel",
    "master_bits",
}  # recorded per run, as the optimizer resolved them
BF16_MODEL = {"master", "master16"}  # optimizer kinds that train a coatstate.cast_model'd model
