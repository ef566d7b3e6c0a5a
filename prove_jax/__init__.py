"""prove-jax: ProVe / MARS block decoding with Qwen2 models in JAX and Flax NNX.

A proposer drafts K tokens per forward (with <|mask|> tokens); a verifier, or in lossless mode
the proposer itself, decides how many to commit. Sub-packages, lowest layer first: models,
checkpoints and data, decoding, training, evaluation, cli. Importing this package loads no
jax; import the sub-package you need (e.g. `from prove_jax.decoding import Decoder`).
"""

__version__ = "0.1.0"
