"""A warm engine start: `weightcache warm-engine` keeps an interpreter with torch, vLLM and transformers
imported (no CUDA context) and forks engines from it; `weightcache run -- CMD` is the caller's stand-in.
See docs/warm-start.md. messages (the wire), command (what Python runs a command line), identity (what the
warm interpreter was made from), server, engine (the forked child), client, launcher (spawn children)."""
