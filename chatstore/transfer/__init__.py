"""What moves KV between the engine and the store: the connector (the engine's KVConnector), the
layer loader and read buffer (the read stream), the layer saver (the write stream), and the
chunk views a load reads from. The only package that imports both `engine` and `store`.

connector = create_connector(store, runtime.kv_cache, runtime.runner.rope)
"""

from chatstore.transfer.connector import StoreConnector, create_connector

__all__ = ["StoreConnector", "create_connector"]
