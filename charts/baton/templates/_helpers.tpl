{{/* Names and labels. */}}
{{- define "baton.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "baton.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else if contains (include "baton.name" .) .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name (include "baton.name" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{/* Selector labels of one component: (dict "root" $ "component" "gateway") */}}
{{- define "baton.selectorLabels" -}}
app.kubernetes.io/name: {{ include "baton.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "baton.labels" -}}
{{ include "baton.selectorLabels" . }}
app.kubernetes.io/part-of: baton
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .root.Chart.Name .root.Chart.Version }}
{{- end -}}

{{- define "baton.image" -}}
{{- $img := index .root.Values.image .kind -}}
{{- printf "%s:%s" $img.repository (default .root.Chart.AppVersion $img.tag) -}}
{{- end -}}

{{- define "baton.secretName" -}}
{{- default (printf "%s-secrets" (include "baton.fullname" .)) .Values.secrets.existingSecret -}}
{{- end -}}

{{- define "baton.clusterTokenSecretName" -}}
{{- default (printf "%s-cluster-token" (include "baton.fullname" .)) .Values.clusterAuth.existingSecret -}}
{{- end -}}

{{/* BATON_CLUSTER_TOKEN from its Secret: what internal gRPC ports ask for and their callers send; and
BATON_CLUSTER_TOKEN_ROTATING, the other token admitted during a rotation (only while its key exists). */}}
{{- define "baton.clusterTokenEnv" -}}
- name: BATON_CLUSTER_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ include "baton.clusterTokenSecretName" . }}
      key: {{ .Values.clusterAuth.secretKey }}
- name: BATON_CLUSTER_TOKEN_ROTATING
  valueFrom:
    secretKeyRef:
      name: {{ include "baton.clusterTokenSecretName" . }}
      key: {{ .Values.clusterAuth.rotatingSecretKey }}
      optional: true
{{- end -}}

{{/* Changes when the values naming the token change (a rotation step): the pods roll and read it anew.
A Secret of yours (existingSecret) changed in place needs `kubectl rollout restart` instead. */}}
{{- define "baton.clusterAuthChecksum" -}}
{{- pick .Values.clusterAuth "token" "rotatingToken" "existingSecret" "secretKey" "rotatingSecretKey" | toJson | sha256sum -}}
{{- end -}}

{{- define "baton.schedulerAddress" -}}
{{- printf "%s-scheduler:%v" (include "baton.fullname" .) .Values.scheduler.port -}}
{{- end -}}

{{/* The model directory inside pods; empty: the default model baked into the images. */}}
{{- define "baton.modelPath" -}}
{{- .Values.model.path -}}
{{- end -}}

{{/* Settings every platform pod reads: the ConfigMap, the Secret, tracing. */}}
{{- define "baton.platformEnv" -}}
envFrom:
  - configMapRef:
      name: {{ include "baton.fullname" . }}-settings
  - secretRef:
      name: {{ include "baton.secretName" . }}
env:
  {{- include "baton.tracingEnv" . | nindent 2 }}
  {{- include "baton.clusterTokenEnv" . | nindent 2 }}
{{- end -}}

{{/* Each service names itself (baton-gateway, baton-scheduler, ...); the OTLP endpoint is shared. */}}
{{- define "baton.tracingEnv" -}}
- name: OTEL_EXPORTER_OTLP_ENDPOINT
  value: {{ .Values.tracing.otlpEndpoint | default "http://localhost:4317" | quote }}
{{- end -}}

{{/* Where the gateway reads its gRPC TLS Secret (gateway.grpc.tlsSecret). */}}
{{- define "baton.grpcTlsDir" -}}
/etc/baton/grpc-tls
{{- end -}}

{{- define "baton.modelVolumeMount" -}}
{{- if .Values.model.volume -}}
- name: model
  mountPath: {{ .Values.model.mountPath }}
  readOnly: true
{{- end }}
{{- end -}}

{{- define "baton.modelVolume" -}}
{{- if .Values.model.volume -}}
- name: model
  {{- toYaml .Values.model.volume | nindent 2 }}
{{- end }}
{{- end -}}

{{/* nodeSelector, tolerations, affinity of a component's values. */}}
{{- define "baton.placement" -}}
{{- with .nodeSelector -}}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}

{{/* A PodDisruptionBudget: (dict "root" $ "component" "gateway" "pdb" .Values.gateway.pdb) */}}
{{- define "baton.pdb" -}}
{{- if .pdb.enabled }}
---
apiVersion: policy/v1
kind: PodDisruptionBudget
metadata:
  name: {{ include "baton.fullname" .root }}-{{ .component }}
  labels:
    {{- include "baton.labels" . | nindent 4 }}
spec:
  {{- if hasKey .pdb "minAvailable" }}
  minAvailable: {{ .pdb.minAvailable }}
  {{- else }}
  maxUnavailable: {{ .pdb.maxUnavailable }}
  {{- end }}
  selector:
    matchLabels:
      {{- include "baton.selectorLabels" . | nindent 6 }}
{{- end }}
{{- end -}}

{{- define "baton.podSecurity" -}}
securityContext:
  {{- toYaml .Values.podSecurityContext | nindent 2 }}
{{- with .Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}
