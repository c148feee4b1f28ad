"""Strom's threshold compression (Interspeech 2015): the codec of a compressed update and the
trainers' error feedback that produces one.

Imports: adamps.layout only."""
