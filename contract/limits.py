"""The largest job anyone may ask for: every size and count a job file holds is bounded here.

Checked before anything is allocated (the job schema's ``Field(le=...)``, ``ParallelConfig``,
the YAML reader), so a hostile or mistyped number is a quick validation error, never a
coordinator that allocates the world. One home: everyone else imports these.
"""

from __future__ import annotations

# -- the job file itself ------------------------------------------------------
MAX_JOB_FILE_BYTES = 256 * 1024  # a job file, or a spec_yaml sent to the coordinator
MAX_YAML_NODES = 10_000  # scalars + collections after alias expansion (a job file holds ~50)
MAX_YAML_ALIASES = 100  # '*name' references in one document
MAX_YAML_DEPTH = 32  # nested mappings/sequences (a job file nests 3 deep)
MAX_ERRORS_SHOWN = 20  # problems listed in one answer; the rest are counted

# -- layout -------------------------------------------------------------------
MAX_WORLD_SIZE = 1 << 20  # 1,048,576 ranks
MAX_NODES = MAX_WORLD_SIZE
MAX_SLOTS_PER_NODE = 1024
MAX_PARALLEL_SIZE = MAX_WORLD_SIZE  # tp, pp, cp, ep, etp (each also divides the world)
MAX_VPP = 1024  # virtual pipeline chunks per rank

# -- model shape --------------------------------------------------------------
MAX_LAYERS = 4096
MAX_HIDDEN = 1 << 17  # 131,072
MAX_HEADS = 4096
MAX_FFN_HIDDEN = 1 << 20
MAX_SEQ_LEN = 1 << 22  # 4,194,304 tokens
MAX_VOCAB = 1 << 22
MAX_EXPERTS = 4096
MAX_CAPACITY_FACTOR = float(MAX_EXPERTS)  # at experts/top_k every token fits already

# -- comm-check ---------------------------------------------------------------
MAX_COMM_BYTES = 1 << 30
MAX_COMM_ITERS = 10_000
MAX_COMM_WARMUP = 1_000
MAX_SOAK_S = 7 * 24 * 3600.0

# -- training counts ----------------------------------------------------------
MAX_STEPS = 100_000_000
MAX_BATCH = 1 << 24  # global_batch and micro_batch, in sequences
MIN_SEED, MAX_SEED = -(1 << 63), (1 << 64) - 1  # what torch.manual_seed takes
MAX_RESTARTS = 1000
MAX_COLLECTIVE_TIMEOUT_S = 86_400.0

# -- planning -----------------------------------------------------------------
PLAN_MAX_RANKS_LISTED = 4096  # above this, a layout document holds per-kind summaries only
