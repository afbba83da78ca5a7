"""kvrouter as a Gateway API Inference Extension Endpoint Picker: Envoy carries the bytes, kvrouter
decides, over Envoy's ext_proc protocol (one gRPC stream a request).  The picker answers with
``x-gateway-destination-endpoint`` (and envoy.lb metadata) chosen by the same ``RequestPipeline`` as
``kvrouter serve``; Envoy sends the request to that vLLM instance (ORIGINAL_DST).

| module     | role                                                                  | I/O        |
|------------|-----------------------------------------------------------------------|------------|
| protocol   | the Endpoint Picker Protocol's messages, read and written              | none       |
| endpoints  | instance <-> ``ip:port``; the ordered fallback list                    | none       |
| exchange   | one request on one stream: a thin shell around ``RequestPipeline``     | none       |
| picker     | options; the gateway's components the exchanges read                 | none       |
| metrics    | the picker's own Prometheus metrics                                   | none       |
| server     | the gRPC server (ext_proc, health), the admin HTTP app, lifecycle      | gRPC, HTTP |
"""

from .picker import Picker, PickerOptions
from .server import PickerServer, build_admin

__all__ = ["Picker", "PickerOptions", "PickerServer", "build_admin"]
