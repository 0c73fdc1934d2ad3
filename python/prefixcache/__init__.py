"""prefixcache: a prefix-cache manager for hybrid attention / recurrent-state LLM serving engines."""
