"""A worker group: one model served by N processes (one a Mac), seen by the router as one worker.

Contract:
- Rank 0 is the worker of a single process (gRPC, HTTP, metrics, scheduler, block
  manager, prefix cache, sampler). Its engine's step is unchanged, schedule -> prepare ->
  forward -> sample -> postprocess; its model runner (`leader.GroupRunner`) also sends each
  step's plan to the members, and takes the previous stage's hidden state before its own
  layers. The members (`member.py`) run exactly the steps rank 0 plans, in the order they
  were sent: no scheduler is replicated, nothing is kept in step by determinism. Rank 0
  finishes its steps in that order too (a batch finished out of it loses the group).
- Pipelined batches (`pipelined.py`, a pipeline of P stages): P virtual engines, each an
  ordinary `Engine` over 1/P of the KV pool (its block ids and state slots offset into the
  one pool), with at most one batch in flight each; a request lives in one of them. So one
  request's context is at most that share: the engines' `max_model_len` says so, and a
  longer request is refused as any request past `max_model_len` is.
- A plan is token ids, per-sequence positions, state slots and block-table changes, and
  the handles of sequences gone (`wire.py`: a struct header and int32 arrays, no pickle).
  Every rank uses the same block ids; the pool has the fewest blocks any rank can hold.
  Before any rank loads, rank 0 checks that every rank's weights and KV share fit in what
  it gives (`memory.py`); a group that does not fit is refused, permanently, on every rank.
- Pipeline parallel (`stage.py`): contiguous runs of layers per rank, in proportion to
  the memory each rank gives (`memory.py`: free memory, or `--memory-budget`; or
  `--group-shares`); rank N-1 embeds, rank 0 holds the last layers and the head; hidden
  states go rank r -> r-1 through MLX's send / recv on the CPU stream. Each rank reads
  only its layers' weight files and evaluates only its part.
  Tensor parallel: mlx-lm's `shard()`, MLX's sharded linears' all-reduces.
- Tensors move only through `mx.distributed` (the ring backend, MLX_HOSTFILE / MLX_RANK,
  as mlx.launch sets them). Beside it a TCP side channel (`channel.py`) carries plans,
  notices and heartbeats, authenticated with the join token.
- Exact: a group's tokens and logprobs are the single process's, bit for bit, under
  pipeline parallelism (tests/test_group.py); tensor parallelism sums in another order.
- A pipeline step that raises on any rank (a request that breaks its layers) is not a
  fault of the group: that rank says FAILED in place of READY (no hidden state comes, so
  no rank waits in a collective), rank 0's step raises as a single worker's does, and its
  engine loop fails the request that breaks it alone. Under tensor parallelism a rank
  cannot be unblocked: the group is lost, and the router fails a request that lost two
  workers as poison.
- Faults: nothing waits for ever. A member that dies, stops or wedges is noticed within
  `--group-timeout` (a closed connection at once; silence or an unfinished step by
  deadline); then every process of the group exits (75), the router resumes the streams
  elsewhere, and whatever started the group (`orchard up`, launchd, Ray) starts it again
  after a backoff. A rank that cannot start exits as `cluster/exit_codes.py` says: 78 for
  what starting again cannot fix (a setting, a wrong join token, a model that does not
  load or that rank 0 does not share; a member tells rank 0 so, which exits 78 too), 75
  otherwise (a member late or gone, a busy port); no launcher restarts a 78. No rank starts
  without a join token. A peer that does not prove it is never admitted, and its handshake
  holds no member up: each has a deadline of its own, handshakes at once are bounded per
  peer address and in total (a new one takes the oldest's slot), and a member whose try
  fails tries again until its join deadline.
- Start-up: every wait has a deadline within the join timeout, and the side channel is read
  from a member's join on (a member gone while rank 0 admits is dropped and may join
  again; gone later, the group is lost). MLX's ring init holds the GIL, so its bound is a
  C library timer (`deadline.py`, `--group-timeout`) that ends the process with 75.
- The disk KV tier (`kv.py`, `--kv-disk-dir` on each rank): a store a rank, of its own
  layers; rank 0's tier decides what is saved and loaded, and the members copy out, read
  and install the same blocks in step (KV_SAVE, KV_READ / KV_READ_DONE, KV_APPLY, in order
  with the plans). A load takes the fewest good blocks any rank read; a member's missing,
  failed or late read costs a recompute, never a wrong block.
- Stop: rank 0's SIGTERM drains it, then SHUTDOWN tells every member to exit 0; a member's
  SIGTERM asks rank 0 for exactly that (STOP), and a member not yet serving just exits 0.
"""
