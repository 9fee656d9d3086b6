"""The format: bytes and documents, no I/O (FORMAT.md). Nothing here reads or writes a store."""
