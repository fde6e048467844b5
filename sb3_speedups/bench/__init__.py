"""
Side-by-side benchmark of our algorithms against stock SB3: the same config and seeds, runs alternating, each in a
fresh subprocess; ratio of median ``learn()`` times, final deterministic returns, peak memory, JSON + PNG.
"""
