"""The built-in hf_paged cache backends, installed as the `hf_paged_plugins` package.

Each module is one plugin, registered through the `hf_paged` entry-point group in pyproject.toml exactly as a
third-party plugin would be:

    dynamic  transformers DynamicCache
    static   transformers StaticCache (contiguous, reserves `max_cache_len` slots per sequence)
    paged    hf_paged.PagedCache (fixed-size blocks from a shareable BlockPool)
"""
