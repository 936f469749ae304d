"""`art_adapters.utils.deployment.wandb` (ART's path): a checkpoint as a W&B artifact."""

from ...deployment import WandbDeploymentConfig, deploy_wandb

__all__ = ["WandbDeploymentConfig", "deploy_wandb"]
