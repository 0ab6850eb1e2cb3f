"""Host side: a recipe. Its YAML text read defensively and `-o` overrides (yaml_text), loaded, validated against
the schema and resolved (load), its MaxText keys checked against the installed MaxText (maxtext_keys)."""
