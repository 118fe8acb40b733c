"""The API: LM, the request value, prompts, calibration, the drop-in for transformers' generate."""
