"""Defaults of a model's optional fields, one definition each: the job schema's ``model`` section
(``kinds.train.spec``) and the model library's configs (``models.gpt.GPTConfig``,
``models.moe.MoEConfig``) both take them from here. Pure constants, no imports."""

FFN_HIDDEN = None              # None: 4 * hidden
POSITION_EMBEDDING = "learned"  # "learned" | "rope"
TIE_EMBEDDINGS = True
MOE_TOP_K = 2
MOE_EVERY = 1                  # every n-th layer is a mixture of experts
MOE_AUX_LOSS = 0.01
MOE_CAPACITY_FACTOR = None     # None: no token is dropped
