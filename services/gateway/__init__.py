"""The gateway: GenerateService over grpc.aio, in front of the engine's ZMQ sockets."""
