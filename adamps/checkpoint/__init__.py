"""Checkpoints and the files made of them: `adamps checkpoint save|restore`, their format and
schema, the series a controller keeps, `adamps export` and `adamps table load`.

Imports: adamps.client, adamps.wire, adamps.security and the server's update rules and row
blocks (the same arithmetic as the servers'); no role."""
