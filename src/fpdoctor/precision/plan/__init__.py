"""plan: the smallest keep-in-fp32 set (with op-level fixes), verified, and the code that applies it."""
