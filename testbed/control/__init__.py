"""The control plane, with no clock and no I/O: the request book, the KV hand-off ledger,
dispatch policies and the per-attempt transfer table. The real router and the simulator drive it."""
