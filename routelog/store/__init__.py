"""Operations on a store at an fsspec URL: write, read, seal, drop, gc, verify, annotate."""
