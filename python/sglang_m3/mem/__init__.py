"""MiniMax-M3 KV memory: pool construction and the exact per-token byte budget."""
