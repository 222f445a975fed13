"""Adapters that connect existing trainers to a running pool.

* :mod:`rolloutpool.integrations.trl` — Hugging Face TRL's ``GRPOTrainer`` (``trl==1.16.0``,
  ``pip install 'rolloutpool[trl]'``): a rollout hook that generates through the router and a
  callback that pushes checkpoints to the updater.

Nothing is imported here: ``import rolloutpool.integrations`` works without any trainer library
installed; each adapter module imports its framework itself and says what to install if it is
missing.
"""
