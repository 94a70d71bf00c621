"""Every benchmark (``coevo bench ...``): each returns a JSON-able dict; speed lives here, not in tests."""
