"""The gateway's OpenAI-compatible HTTP front: `/v1/completions`, `/v1/chat/completions`,
`/v1/models`, `/health` and `/metrics`, served by uvicorn on the gateway's own event loop over
the same `Gateway` core as the gRPC front.

- schema.py: the request bodies (pydantic), as OpenAI documents them, plus our extensions.
- translate.py: an OpenAI request -> a public `GenerateRequest`; chunks -> OpenAI response objects.
- errors.py: exceptions -> OpenAI's error JSON and HTTP status.
- app.py: the routes (FastAPI), server-sent events, client disconnects, the request's span.
- server.py: uvicorn embedded in the running loop, started and stopped with the gateway.
"""
