"""`make perf`: what the engine itself costs (`engine`: bandwidth, latency curves, one forward's
breakdown, AR and SpS against `transformers`), the peers beside it (`peers`), the host reads of a
decoding step (`host_reads`) and the prompts and timed generations they share (`workload`)."""
