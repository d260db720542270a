"""What several parts share about reaching each other safely: secret files and CURVE keys (`keys`), Redis
connection settings (`redisconf`). Imports nothing here, so the settings root loads only the modules it needs."""
