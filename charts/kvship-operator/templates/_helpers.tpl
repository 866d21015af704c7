{{/* Release-scoped names and labels. */}}
{{- define "kvship-operator.name" -}}
{{- .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "kvship-operator.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "kvship-operator.selectorLabels" -}}
app.kubernetes.io/name: {{ include "kvship-operator.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "kvship-operator.labels" -}}
{{ include "kvship-operator.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: kvship
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end -}}

{{- define "kvship-operator.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "kvship-operator.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* Rules for the namespaced objects the operator reads and applies. */}}
{{- define "kvship-operator.namespacedRules" -}}
- apiGroups: ["kvship.io"]
  resources: ["llmdeployments"]
  verbs: ["get", "list", "watch", "patch"]
- apiGroups: ["kvship.io"]
  resources: ["llmdeployments/status"]
  verbs: ["get", "patch"]
# the built-in autoscaler sets replicas through the scale subresource
- apiGroups: ["kvship.io"]
  resources: ["llmdeployments/scale"]
  verbs: ["get", "patch"]
- apiGroups: ["apps"]
  resources: ["statefulsets"]
  verbs: ["get", "list", "watch", "create", "patch"]
# delete: rollouts replace pods one at a time, after a surge pod on the new spec is ready
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["get", "list", "watch", "delete"]
# children are watched (list/watch) so that hand edits and deletions are repaired
- apiGroups: [""]
  resources: ["services", "persistentvolumeclaims"]
  verbs: ["get", "list", "watch", "create", "patch"]
- apiGroups: ["policy"]
  resources: ["poddisruptionbudgets"]
  verbs: ["get", "list", "watch", "create", "patch"]
- apiGroups: [""]
  resources: ["events"]
  verbs: ["create", "patch"]
# autoscaling.provider hpa / keda: the operator emits the object, and deletes the one it owns
# when the provider changes or autoscaling is turned off (the only delete verb it holds)
- apiGroups: ["autoscaling"]
  resources: ["horizontalpodautoscalers"]
  verbs: ["get", "create", "patch", "delete"]
- apiGroups: ["keda.sh"]
  resources: ["scaledobjects"]
  verbs: ["get", "create", "patch", "delete"]
# spec.routing: the router Deployment (watched, repaired like the other children) and the
# InferencePool of mode gateway; the router's children are deleted when routing turns off
- apiGroups: ["apps"]
  resources: ["deployments"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
- apiGroups: [""]
  resources: ["services"]
  verbs: ["delete"]
- apiGroups: ["inference.networking.k8s.io"]
  resources: ["inferencepools"]
  verbs: ["get", "create", "patch", "delete"]
# the router's own ServiceAccount and Role to read its replicas' EndpointSlices (--discover-k8s);
# granting a rule needs holding it, hence the operator's read of endpointslices
- apiGroups: [""]
  resources: ["serviceaccounts"]
  verbs: ["get", "create", "patch", "delete"]
- apiGroups: ["rbac.authorization.k8s.io"]
  resources: ["roles", "rolebindings"]
  verbs: ["get", "create", "patch", "delete"]
- apiGroups: ["discovery.k8s.io"]
  resources: ["endpointslices"]
  verbs: ["get", "list", "watch"]
{{- end -}}

{{- define "kvship-operator.webhookService" -}}
{{- printf "%s-webhook" (include "kvship-operator.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "kvship-operator.webhookSecret" -}}
{{- printf "%s-webhook-tls" (include "kvship-operator.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}
