"""Test infrastructure shared by the test tiers, the demos and the benchmarks."""
