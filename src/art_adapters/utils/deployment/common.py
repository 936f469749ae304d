"""`art_adapters.utils.deployment.common` (ART's path): the shapes every provider shares."""

from ...deployment import DeploymentConfig, DeploymentError, DeploymentResult, Provider

__all__ = ["DeploymentConfig", "DeploymentError", "DeploymentResult", "Provider"]
