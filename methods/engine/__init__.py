"""The machinery every method shares: the target's forward over a tree and its KV cache
(`runner`, `kv_cache`), draft trees and their masks (`tree`, `static_trees`), verification
(`acceptance`), sampling, the stopping rule, where derived files are kept (`storage`) and what the
machine is (`hardware`: its CPU flags and ISA, the key of its profile; the measuring is `machine/`'s)."""

