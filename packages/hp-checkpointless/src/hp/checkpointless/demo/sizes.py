"""The demo model sizes, importable without torch (the `hp` CLI validates against them)."""

MODEL_SIZES = {  # name -> (d_model, layers, heads); "25m" is the INFRA baseline model
    "tiny": (64, 2, 4),
    "small": (128, 4, 4),
    "25m": (512, 6, 8),
}
