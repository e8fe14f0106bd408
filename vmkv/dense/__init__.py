"""Dense slots: what the layouts that give each sequence one contiguous slot share (vattention,
contiguous): the step plan, attention over the slots, and sequence lookups."""
