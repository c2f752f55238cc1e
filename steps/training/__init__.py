"""Library of steps/train.py, one module per job: `plan` (batches and the shard reader), `ttt` (the
training-time-test unroll and loss), `loop` (trainer, optimizer step, the loop), `checkpoint` (save, resume)."""
