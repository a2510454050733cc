"""Optimizers over ``compile_sharded``'s DTensor parameters; they know nothing of graphs, and communicate through the
parameters' own mesh (GaLore's refresh steps) or the replica groups' ``Collectives`` they are handed (DeMo, DiLoCo)."""

from simplefsdp.optim.demo import DeMo
from simplefsdp.optim.diloco import DiLoCo
from simplefsdp.optim.exchange import ONE_GROUP, Collectives
from simplefsdp.optim.galore import GaLoreAdamW, state_bytes, top_right_singular_vectors

__all__ = ["ONE_GROUP", "Collectives", "DeMo", "DiLoCo", "GaLoreAdamW", "state_bytes", "top_right_singular_vectors"]
