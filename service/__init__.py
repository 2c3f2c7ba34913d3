"""The front end of meshserve: HTTP API, job contract and Redis store. Imports no JAX."""
