"""The allowed values of every enum-like option, defined once: the config schema (`config.CHOICES`) and the
parts that take them (losses, learner, scorer, rollout backends, decode placement) all read them here.
Plain tuples, no imports: any module may use them."""

# ULORL.md §2: importance sampling (TOIS = pois with one segment)
IS_MODES = ("pois", "sais")
# ULORL.md §3: which well-mastered positive tokens are masked
MASK_MODES = ("none", "mpt", "dmmpt")
# DMMPT's entropy: per sample H̄_i (the paper) or the batch mean
ENTROPY_MODES = ("sample", "batch")
# verl's agg_loss modes (token-mean is Eq. 10)
LOSS_AGG_MODES = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
# verl's policy_loss.loss_mode values implemented here (rl/policy_losses.py POLICY_LOSSES)
POLICY_LOSS_MODES = ("vanilla", "gspo", "cispo", "geo_mean", "sapo")
# per-layer rematerialisation in the learner's backward pass (rl/learner.py REMAT_POLICIES)
REMAT = ("none", "full", "dots", "dots_saveable", "attention")
REWARD_KINDS = ("rule", "verifier", "custom")
# rule kind: the last \boxed{} (the paper) or math-verify's own extraction
EXTRACTIONS = ("boxed", "math_verify")
# math-verify's own parse() options (reward.extraction_config, reward.fallback_mode, reward.extraction_mode)
MV_EXTRACTION_TARGETS = ("latex", "expr", "string")
MV_FALLBACK_MODES = ("first_match", "no_fallback")
MV_EXTRACTION_MODES = ("any_match", "first_match")
ROLLOUT_BACKENDS = ("engine", "jetstream")
# where the rollout decodes (decode/placement.py)
DECODE_MESHES = ("auto", "learner", "replicate", "shard", "first_device")
# the decode engine's KV cache (decode/cache_layout.py): shared pages, or one max-length row per slot
KV_CACHES = ("paged", "dense")
# a sample preempted for want of KV pages: prefilled again from its tokens, or its pages kept in host memory
PREEMPTIONS = ("recompute", "swap")
DTYPES = ("float32", "bfloat16", "float16")
ON_BAD_ROW = ("skip", "error")
ON_SAVE_ERROR = ("stop", "continue")
