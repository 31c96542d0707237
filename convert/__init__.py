"""GGUF → MLX model directory converter (installed as ``ds4_mlx.convert``)."""
