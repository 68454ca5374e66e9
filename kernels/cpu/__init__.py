"""The CPU serving paths of the text core, in torch (the C kernels they call are in kernels/native/):
paged attention over pages with an exact sink correction (``paged_attention``; its long sliding
prompts in ``sliding_prefill``), grouped expert matmuls (``moe``), and huge-page-advised memory for
the weights and the KV pools (``huge_pages``)."""
