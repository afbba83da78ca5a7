"""The OpenAI-compatible gateway (aiohttp): parse, tokenize, route, proxy, observe."""
