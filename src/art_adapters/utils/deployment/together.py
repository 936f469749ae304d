"""`art_adapters.utils.deployment.together` (ART's path): Together's deployment."""

from ...deployment import TogetherDeploymentConfig, TogetherJobStatus, deploy_to_together, together_model_name

__all__ = ["TogetherDeploymentConfig", "TogetherJobStatus", "deploy_to_together", "together_model_name"]
