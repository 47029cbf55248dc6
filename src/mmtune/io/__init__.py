"""File-system helpers shared by data, training and evaluation (no imports of theirs at module level)."""
