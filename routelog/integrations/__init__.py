"""Drop-in glue for the trainers people use: each module maps a trainer's own rollout output and micro-batches to
routelog's writer, :class:`~routelog.align.AlignmentPlan` and :class:`~routelog.megatron.MegatronReplay`.

* :mod:`routelog.integrations.megatron` — a forward-step hook for users who drive megatron-core directly (and the
  base the others build on);
* :mod:`routelog.integrations.verl`, :mod:`routelog.integrations.slime`, :mod:`routelog.integrations.nemo_rl` —
  the rollout side (write the engine's routing, carry only sample ids) and the training side (replace the
  trainer's replay installation) of each framework.

Trainer packages are imported lazily, inside the functions that need them, so ``import routelog`` never needs one.
"""
