"""`python -m hf_paged serve MODEL ...` (the same as the `hf-paged` command)."""

from .serve.cli import main

if __name__ == "__main__":
    main()
