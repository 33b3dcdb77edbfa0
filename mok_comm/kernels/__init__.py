"""Device bodies of mok_comm (host launch glue: ``mok_comm.ops``)."""
