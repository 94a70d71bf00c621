"""The method of docs/algorithm.md as code that does no I/O: integrated and consistency rewards, advantages,
rewrite acceptance (``scoring``), the prompts and the parsers of what models answer (``prompts``), and
the environment rewriter's critic and proposals (``rewriter``)."""
