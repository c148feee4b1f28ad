"""The wire: msgpack and the frames (protocol, the only module that knows msgpack), the aiohttp
shell of every role's HTTP service (web, looplag) and the bounds on what one request may
allocate (limits).

Imports: adamps.security, adamps.config, adamps.layout, adamps.metrics; nothing of the roles,
the client or the servers."""
