"""The megatron-core trainer backend (`trainer.backend: megatron`); needs megatron-core installed."""
