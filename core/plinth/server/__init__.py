"""The OpenAI- and Anthropic-compatible HTTP server (``plinth serve``).

``async_engine`` drives one engine from a worker thread for asyncio; ``app`` builds the FastAPI
application; ``openai_api`` / ``anthropic_api`` hold the generation routes; ``launch`` runs uvicorn.
"""
