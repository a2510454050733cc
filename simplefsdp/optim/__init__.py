"""Optimizers over ``compile_sharded``'s DTensor parameters; they know nothing of graphs, and communicate (on GaLore's
refresh steps) through the parameters' own mesh."""

from simplefsdp.optim.galore import GaLoreAdamW, state_bytes, top_right_singular_vectors

__all__ = ["GaLoreAdamW", "state_bytes", "top_right_singular_vectors"]
