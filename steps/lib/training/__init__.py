"""Library of steps/train.py, one module per job, in reading order: `plan` (batches and the shard reader),
`ttt` (the training-time-test unroll and loss), `trainer` (what an optimizer step works on), `checkpoint`
(save, resume), `evaluate` (the held-out split, τ_sim, the best checkpoint), `loop` (the schedule, the
optimizer step, the loop over the plan)."""
