"""World rank 0: the event loop, the pure scheduler and pool binding, the workflow trees and the
experience store they journal, held-out evaluation and the run's recorder and metric sinks."""
