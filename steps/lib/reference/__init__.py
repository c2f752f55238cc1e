"""The reference server: the reference engine behind SGLang's HTTP API subset."""
