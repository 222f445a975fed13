"""What a pool on one machine runs besides its replicas and services: a local ``redis-server``
(:mod:`rolloutpool.local.redis`) and the tiny Llama models it serves when given none, built
offline and cached (:mod:`rolloutpool.local.models`; the LoRA base and adapters:
:mod:`rolloutpool.local.lora_models`)."""
