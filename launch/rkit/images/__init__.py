"""Host side: Apptainer images. The content-addressed cache, inspect and verify (store), bit-reproducible SIFs
(repro), builds (build), what an image holds (env), its probe and the agent bound into images that lack it (probe), a
run's image identity and resolving a recipe's `image:` (identity), `rkit image diff` (diff). Imports one way: store,
repro <- build <- probe, env <- identity <- diff."""
